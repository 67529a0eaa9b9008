import pi_env_check as check

WANT = "500.50"  # the amount column of sales.csv, summed: kept here, where the agent cannot edit it
check.seal("/tests")
ran = check.run(["python3", "/app/total.py"], user="nobody", timeout=30)
got = ran.stdout.strip()
print(f"expected {WANT}, got {got!r}")
check.write_reward(1 if ran.ok and got == WANT else 0, directory="/logs/verifier")
