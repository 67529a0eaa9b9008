from pi_env.scripted.server import main

main()
