import sys

from p2psync.cli.main import main

sys.exit(main())
