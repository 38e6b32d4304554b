"""The explanations: the worked-example walkthrough, `inspect`, and the presets listing."""
