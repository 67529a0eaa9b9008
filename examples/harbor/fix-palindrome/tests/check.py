import json
import sys

sys.path.insert(0, "/app")
from palindrome import is_palindrome  # noqa: E402

CASES = [("racecar", True), ("A man, a plan, a canal: Panama", True), ("", True),
         ("No 'x' in Nixon", True), ("hello", False), ("ab", False), ("12 21", True)]
passed = sum(1 for text, want in CASES if is_palindrome(text) is want)
with open(sys.argv[1], "w") as handle:
    json.dump({"reward": passed / len(CASES), "passed": passed, "total": len(CASES)}, handle)
print(f"{passed}/{len(CASES)} checks passed")
