"""vLLM with kvblend's connector against vanilla vLLM: ``kvblend bench vllm``.

Its speed (`speed`: TTFT by prompt length, requests/s, a streaming client's pauses while long
prompts arrive), its answers on the NQ benchmark's prompts paired with the engine's (`nq`,
``--nq``), and the OpenAI-compatible server both run as (`server`). It runs in vLLM's
environment (``.venv-vllm``).
"""
