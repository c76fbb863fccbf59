"""`python -m launch`: the pagedserve command."""
import sys

from launch.launch import main

sys.exit(main())
