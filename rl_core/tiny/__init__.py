ARITHMETIC = "tiny-arithmetic"  # config value naming the arithmetic recipe's offline assets (rl_core/tiny/arithmetic.py)
