"""``horovod.spark.torch``'s place: ringtrain has no Spark Estimator, and says so on import.

Horovod's ``TorchEstimator`` trains on a Spark DataFrame through its Store (Petastorm files).
ringtrain does not carry that API: a Spark job starts ranks with :func:`ringtrain.spark.run`
(Horovod's ``horovod.spark.run``) or with pyspark's own ``TorchDistributor``, and each rank
reads its own share of the data (docs/engines.md). Importing this module raises an ImportError
that says so, instead of "No module named ringtrain.spark.torch".
"""

from __future__ import annotations

raise ImportError(
    "ringtrain has no Spark Estimator (horovod.spark.torch.TorchEstimator and its Store are "
    "not carried over).\nHINT: start the ranks from Spark with ringtrain.spark.run(fn, "
    "num_proc=N) (Horovod's horovod.spark.run) or pyspark's TorchDistributor, and read each "
    "rank's share of the data inside fn (for example Parquet written by Spark): see "
    "docs/engines.md."
)
