from bnsurgeon.cli.commands import main

main()
