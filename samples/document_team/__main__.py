import sys

from samples.document_team.run import main

sys.exit(main())
