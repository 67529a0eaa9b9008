#!/bin/bash
cd /  # not the work dir: nothing of the agent's on the check's sys.path
python3 - <<'PY'
import pi_env_check as check

WORDS = [("", 0), (" a  b\tc\n", 3)]
LINES = [("x\ny\n", 2)]
check.seal("/tests")
got = check.calls("textstat", "count_words", [[text] for text, _ in WORDS], user="nobody")
got += check.calls("textstat", "count_lines", [[text] for text, _ in LINES], user="nobody")
ok = [result == want for result, (_, want) in zip(got, WORDS + LINES)]
print("words:", ok)
check.write_reward(sum(ok) / len(ok), directory="/logs/verifier", checks=ok)
PY
