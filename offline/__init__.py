ARITHMETIC = "tiny-arithmetic"  # config value naming the arithmetic recipe's offline assets (offline/arithmetic.py)
# config values naming the tool-calling recipe's offline policy and problems, and its SFT rows (offline/tools_arithmetic.py)
TOOLS_ARITHMETIC = "tiny-tools-arithmetic"
TOOLS_ARITHMETIC_SFT = "tiny-tools-arithmetic-sft"
CHAT_ARITHMETIC = "chat-arithmetic"  # the released-model recipe's questions (offline/chat_arithmetic.py), data only
ARITHMETIC_TEACHER = "tiny-arithmetic-teacher"  # the arithmetic policy's distillation teacher (arithmetic_teacher.py)
