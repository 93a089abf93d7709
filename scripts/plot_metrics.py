"""Learning curves of a run: `python scripts/plot_metrics.py RUN_DIR [--out FILE.png]` (`rl_core/plot.py`)."""

from rl_core.plot import main

if __name__ == "__main__":
    main()
