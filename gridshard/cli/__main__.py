"""``python -m gridshard.cli ...`` = the ``gridshard`` command."""
from .main import main

main()
