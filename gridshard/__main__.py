"""``python -m gridshard ...`` (and ``torchrun -m gridshard train ...``) = the ``gridshard`` command."""
from .cli import main

main()
