"""policyscan on a Ray cluster (Ray Data; `pip install 'policyscan[ray]'`).

PolicyScorer: the engine as a callable class for Dataset.map_batches. read_units: policyscan's own readers as
a Dataset, with its ids and error rows. `policyscan score --ray` runs both and writes the outputs (ray/run.py).
Importing this package needs no Ray: PolicyScorer is a plain callable."""
from policyscan.ray.read import ERROR, SOURCE, TEXT, read_units
from policyscan.ray.scorer import PolicyScorer

__all__ = ["ERROR", "SOURCE", "TEXT", "PolicyScorer", "read_units"]
