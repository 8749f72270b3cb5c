"""Several devices: worker processes, one per GPU (or CPU worker), fed units from one queue."""
