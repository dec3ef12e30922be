"""Hardware profiles and lint (work in progress: the profile loader is usable)."""

from qdsl.lint.profile_loader import bundled_profiles, load_profile, parse_profile

__all__ = ["load_profile", "parse_profile", "bundled_profiles"]
