import sys

from .tools._cli import main

sys.exit(main())
