"""``python -m tvmkv.disco <worker_id> <num_workers> <num_groups> <read_fd> <write_fd>``: a Disco worker
process (started by :class:`tvmkv.disco.TvmkvSession`, not by hand)."""

from .worker import main

main()
