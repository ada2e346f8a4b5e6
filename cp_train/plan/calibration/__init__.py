"""``cp-train-plan --calibrate``: measure this machine and write a hardware profile."""
