import sys

from samples.travel_planner.app import main

sys.exit(main())
