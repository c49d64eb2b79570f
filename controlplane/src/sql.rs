//! A small builder for hand-written aggregate SQL that runs on SQLite and PostgreSQL alike:
//! it numbers placeholders the way each backend wants (`?` or `$n`). Used where an aggregate reads
//! more clearly as SQL than through the query builder.

use sea_orm::{DatabaseBackend, Statement, Value};

#[derive(Debug)]
pub struct Sql {
    backend: DatabaseBackend,
    text: String,
    values: Vec<Value>,
}

impl Sql {
    pub fn new(backend: DatabaseBackend, text: &str) -> Self {
        Self {
            backend,
            text: text.to_owned(),
            values: Vec::new(),
        }
    }

    /// Appends SQL text (never user input).
    pub fn push(&mut self, text: &str) -> &mut Self {
        self.text.push_str(text);
        self
    }

    /// Appends a placeholder bound to `value`.
    pub fn bind(&mut self, value: impl Into<Value>) -> &mut Self {
        self.values.push(value.into());
        match self.backend {
            DatabaseBackend::Postgres => {
                self.text.push('$');
                self.text.push_str(&self.values.len().to_string());
            }
            _ => self.text.push('?'),
        }
        self
    }

    pub fn build(self) -> Statement {
        Statement::from_sql_and_values(self.backend, self.text, self.values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_placeholders_per_backend() {
        let mut pg = Sql::new(DatabaseBackend::Postgres, "SELECT 1 WHERE a = ");
        pg.bind(1).push(" AND b = ").bind("x");
        assert_eq!(pg.build().sql, "SELECT 1 WHERE a = $1 AND b = $2");
        let mut lite = Sql::new(DatabaseBackend::Sqlite, "SELECT 1 WHERE a = ");
        lite.bind(1).push(" AND b = ").bind("x");
        assert_eq!(lite.build().sql, "SELECT 1 WHERE a = ? AND b = ?");
    }
}
