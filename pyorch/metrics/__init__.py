"""Engine statistics (collected in the front-end process) and their loggers (Prometheus, log)."""
