import pi_env_check as check

CASES = [
    ("the cat and the hat and THE bat", "the 3\nand 2\nbat 1\n"),
    ("b a c b a c d", "a 2\nb 2\nc 2\n"),
]
check.seal(__file__)
passed = sum(check.run(["python3", "/app/wordfreq.py"], input=text, user="nobody", timeout=30).stdout == expected
             for text, expected in CASES)
# The program must not be able to read the tests it is checked by (test.sh locked them).
isolated = not check.run(["cat", "/tests/test.sh"], user="nobody").ok
print("passed", passed, "of", len(CASES), "isolated", isolated)
check.write_reward(float(passed == len(CASES) and isolated), directory="/logs/verifier", passed=passed,
                   isolated=isolated)
