"""`python -m k3batch.cli ...`: the same command line as the `k3batch` script (Ray Jobs runs the
driver this way: k3batch.cli.submit)."""

from k3batch.cli import main

if __name__ == "__main__":
    main()
