#!/bin/bash
cd /  # not the work dir: nothing of the agent's on the check's sys.path
python3 - <<'PY'
import pi_env_check as check

CASES = [("", 0), ("a\nb\n", 2), ("a\nb", 2)]
check.seal("/tests")
got = check.calls("textstat", "count_lines", [[text] for text, _ in CASES], user="nobody")
ok = [result == want for result, (_, want) in zip(got, CASES)]
print("lines:", ok)
check.write_reward(sum(ok) / len(ok), directory="/logs/verifier", checks=ok)
PY
