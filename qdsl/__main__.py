import sys

from qdsl.cli.main import main

sys.exit(main())
