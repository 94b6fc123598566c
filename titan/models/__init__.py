"""Model families; importing this package registers their train specs."""

import titan.models.deepseek_v3  # noqa: F401
import titan.models.gpt_oss  # noqa: F401
import titan.models.llama3  # noqa: F401
import titan.models.qwen3  # noqa: F401
import titan.models.qwen3_5  # noqa: F401
import titan.models.qwen3_next  # noqa: F401
import titan.models.qwen3_vl  # noqa: F401
