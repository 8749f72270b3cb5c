"""policyscan's command line; STARTED is when the process began, for the summary's time split."""
import time

# Before torch's import, and set once: `python -m policyscan.cli.main` runs main.py a second time as __main__.
STARTED = time.perf_counter()
