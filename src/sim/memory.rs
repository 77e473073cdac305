//! Shared data in memory, as Envoy keeps it, for the unit tests and the simulations.

use crate::worker::env::SharedData;

/// Shared data in one process's memory, for tests and the simulation: versions as Envoy keeps
/// them (every write a new version).
#[derive(Debug, Default)]
pub struct MemoryData {
    map: std::cell::RefCell<std::collections::HashMap<String, (Vec<u8>, u32)>>,
    version: std::cell::Cell<u32>,
}

impl SharedData for MemoryData {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.map.borrow().get(key).cloned()
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        let mut map = self.map.borrow_mut();
        if let Some((_, current)) = map.get(key) {
            if cas != 0 && cas != *current {
                return false;
            }
        }
        self.version.set(self.version.get() + 1);
        map.insert(key.to_string(), (value.to_vec(), self.version.get()));
        true
    }
}

impl MemoryData {
    /// Bytes held in all values.
    pub fn bytes(&self) -> usize {
        self.map.borrow().values().map(|(v, _)| v.len()).sum()
    }
}
