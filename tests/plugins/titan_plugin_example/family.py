"""The family: titan's test family gelu_llama (Llama 3 with a GELU MLP, an auxiliary loss, a
post-step hook and a [gelu_llama] section), registered from here."""

from tests.families import gelu_llama

gelu_llama.register()
