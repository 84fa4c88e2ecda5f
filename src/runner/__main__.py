from runner.main import main

main()
