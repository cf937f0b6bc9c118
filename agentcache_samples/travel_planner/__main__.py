import sys

from agentcache_samples.travel_planner.app import main

sys.exit(main())
