import json
import subprocess

CASES = [
    ("the cat and the hat and THE bat", "the 3\nand 2\nbat 1\n"),
    ("b a c b a c d", "a 2\nb 2\nc 2\n"),
]
passed = 0
for text, expected in CASES:
    done = subprocess.run(["python3", "/app/wordfreq.py"], input=text, capture_output=True, text=True,
                          user="nobody", group="nogroup", timeout=30)
    passed += done.stdout == expected
# The program must not be able to read the tests it is checked by.
peek = subprocess.run(["cat", "/tests/check.py"], capture_output=True, user="nobody", timeout=30)
isolated = peek.returncode != 0
json.dump({"reward": float(passed == len(CASES) and isolated), "passed": passed, "isolated": isolated},
          open("/logs/verifier/reward.json", "w"))
print("passed", passed, "of", len(CASES), "isolated", isolated)
