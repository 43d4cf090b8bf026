import sys

from distft.cli import main

sys.exit(main())
