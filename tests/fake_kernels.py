"""A stand-in for a Triton kernel module in tests/test_compile_procs.py: `kernel.preload(data)` leaves a file named
data in $FAKE_OUT holding "<pid> <parent pid>" of the process that wrote it; data "boom" fails, "die" ends the
process, "hang" leaves started-<pid> and sleeps for two minutes. Importing it leaves imported-<pid>."""
import os
import time
from pathlib import Path

Path(os.environ["FAKE_OUT"], f"imported-{os.getpid()}").touch()


class _Kernel:
    def preload(self, data: str) -> None:
        if data == "boom":
            raise ValueError("cannot compile this one\r\nsaid ptxas")  # a message of several lines
        if data == "die":
            os._exit(3)
        if data == "hang":
            Path(os.environ["FAKE_OUT"], f"started-{os.getpid()}").touch()
            time.sleep(120)
        Path(os.environ["FAKE_OUT"], data).write_text(f"{os.getpid()} {os.getppid()}")


kernel = _Kernel()
