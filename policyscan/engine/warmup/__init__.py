"""Start-up: kernel variants compiled in parallel while the weights load, on a GPU not compiled for before."""
