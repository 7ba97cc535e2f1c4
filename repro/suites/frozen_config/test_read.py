import settings


def test_default_precision():
    # Innocent on its own, but its read freezes the configuration for the whole process.
    assert settings.PRECISION.get() in ("fp32", "fp16")
