"""Maps the import root `lorafleet` onto the repository's fixed top-level folders.

`operator` and `kernels` would clash with the stdlib / a PyPI package, so they are only ever
imported as `lorafleet.operator` and `lorafleet.kernels`. Subpackages are found per folder, so a
new `worker/lora/` needs no edit here.
"""

from setuptools import find_packages, setup

ROOTS = {
    "lorafleet": "common",
    "lorafleet.worker": "worker",
    "lorafleet.kernels": "kernels",
    "lorafleet.router": "router",
    "lorafleet.operator": "operator",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for package, folder in ROOTS.items():
    package_dir[package] = folder
    packages.append(package)
    for sub in find_packages(folder):
        packages.append(f"{package}.{sub}")
        package_dir[f"{package}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir, package_data={"lorafleet.operator": ["*.yaml"], "lorafleet.kernels.lora": ["tunings/*.json"]})
