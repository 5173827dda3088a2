from p2psync.cli.main import entry

entry()
