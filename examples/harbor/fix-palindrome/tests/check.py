import pi_env_check as check

CASES = [("racecar", True), ("A man, a plan, a canal: Panama", True), ("", True),
         ("No 'x' in Nixon", True), ("hello", False), ("ab", False), ("12 21", True)]
check.seal("/tests")
got = check.calls("palindrome", "is_palindrome", [[text] for text, _ in CASES], user="nobody")
passed = sum(1 for result, (_, want) in zip(got, CASES) if result is want)
print(f"{passed}/{len(CASES)} checks passed")
check.write_reward(passed / len(CASES), directory="/logs/verifier", passed=passed, total=len(CASES))
