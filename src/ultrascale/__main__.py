import sys

from ultrascale.cli import main

sys.exit(main())
