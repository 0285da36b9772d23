"""``python -m autoaccum`` is the ``autoaccum`` command."""

from autoaccum.cli import main

if __name__ == "__main__":
    main(prog_name="autoaccum")
