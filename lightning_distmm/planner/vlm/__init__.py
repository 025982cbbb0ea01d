"""The planner for a vision encoder feeding a language model: presets, module profiles, the search
and the default plan of such models."""
