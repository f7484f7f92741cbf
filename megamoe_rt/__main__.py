import sys

from megamoe_rt.cli.main import main

sys.exit(main())
