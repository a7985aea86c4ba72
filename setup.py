"""Package discovery (the metadata is in pyproject.toml): every package under atlas/ is found, never listed by
hand, and kernels/ is installed as `atlas_kernels` so it never shadows another top-level `kernels`."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["atlas", "atlas.*"]), "atlas_kernels"],
    package_dir={"atlas_kernels": "kernels"},
)
