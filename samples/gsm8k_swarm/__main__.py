import sys

from samples.gsm8k_swarm.run import main

sys.exit(main())
