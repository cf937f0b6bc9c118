import sys

from samples.research_team.run import main

sys.exit(main())
