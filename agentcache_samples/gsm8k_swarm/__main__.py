import sys

from agentcache_samples.gsm8k_swarm.run import main

sys.exit(main())
