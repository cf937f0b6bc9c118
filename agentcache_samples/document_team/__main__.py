import sys

from agentcache_samples.document_team.run import main

sys.exit(main())
