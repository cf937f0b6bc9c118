import sys

from agentcache_samples.research_team.run import main

sys.exit(main())
