"""What watches a training run from beside its loop: Python's collector on the run's schedule
(``collector.py``) and the check of the ranks' collectives (``collective_check.py``)."""
