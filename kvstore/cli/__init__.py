"""The command line: `main` (the composition root, which nothing imports), and the typed
flags (`flags`) and settings (`settings`) that every package's commands are built from."""
