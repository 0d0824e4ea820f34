from spindle_cli.cli import main

main()
