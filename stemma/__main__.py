import sys

from stemma.cli import main

sys.exit(main())
